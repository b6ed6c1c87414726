"""Stateful code contexts: a long-lived jailed interpreter per context (``manager.py``)."""
