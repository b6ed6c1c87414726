"""Tests of the Lambda MicroVM provider, against the emulator and botocore stubs."""
