"""Prefect tasks: one per stage (tasks.stages), the KL-breach policy (tasks.breach), iteration
bookkeeping (tasks.iteration), MLflow tracking (tasks.mlflow_tracking) and Prefect artifacts
(tasks.prefect_artifacts). Imports rlhf_core; never imported by it."""
