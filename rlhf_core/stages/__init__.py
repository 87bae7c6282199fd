"""Every stage of a run, setup ones included; ``registry`` holds their one order."""
