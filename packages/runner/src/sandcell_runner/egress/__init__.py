"""Network egress of a sandbox: policy enforcement by a runner-owned gateway (see manager.py)."""
