"""Every stage of a run, setup ones included (their one order: ``rlhf_core.run.stage_order``)."""
