"""The run directory's state, below the components that read and write it: its layout, lock,
manifests, stage order, lifecycle (commit, rollback, retry), integrity check, format migration,
schedule, reports, and which weights a stage uses. What drives a whole run is ``rlhf_core.control``."""
