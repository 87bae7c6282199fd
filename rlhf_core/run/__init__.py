"""The run as a whole: its directory layout, lock, manifests, lifecycle, schedule, plan and reports."""
