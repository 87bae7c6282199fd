"""The `rlhf` command line: the top of the layers (rlhf_core ← tasks ← flows ← deployments ← rlhf_cli)."""
