"""Checkpoints: the tar export, the hardened restore and its extractor child, the tar
rules both apply, the compression codecs, and which paths a checkpoint keeps.

Imports nothing on purpose: the extractor fork server
(``python -m sandcell_runner.checkpoint.extractor_server``) loads this package first,
and whatever it would load is in every extractor child's memory too.
"""
