"""A run as its users drive it, above the stages: where a run starts or resumes (``plan``: clean-up,
format upgrade, repair), what `rlhf status` and `rlhf query` read (``query``), the gated export
(``export``), and a scheduled retrain's inputs (``retrain_inputs``)."""
