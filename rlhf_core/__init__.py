"""rlhf_core: the library behind the RLHF DAG (no Prefect, no MLflow imports here)."""

__version__ = "0.1.0"
