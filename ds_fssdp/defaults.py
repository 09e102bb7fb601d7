"""Defaults of the ``"fssdp"`` config section that tools without DeepSpeed read too (the report's
replay): written once, here; ``config.py``'s fields take them."""

POLICIES = ("fssdp", "ep", "uniform", "fastermoe", "smartmoe")
DISPATCH_SLACK = 0.03  # fssdp.dispatch_slack
SMARTMOE_INTERVAL = 25  # fssdp.smartmoe_interval
