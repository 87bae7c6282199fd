"""Prefect tasks: one per stage (tasks.stages), the KL-breach policy (tasks.guard), iteration
bookkeeping (tasks.iteration), MLflow tracking (tasks.tracking) and Prefect artifacts
(tasks.reporting). Imports rlhf_core; never imported by it."""
