"""Prefect deployments of the RLHF flows (prefect.yaml) and the local services that run them
(``python -m deployments.services up|down|status|register``)."""
