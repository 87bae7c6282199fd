"""Prefect flows: the pipeline (flows.pipeline.rlhf_pipeline) and single-stage reruns
(flows.stage.rlhf_stage). Wiring only: they import tasks, which import rlhf_core."""
