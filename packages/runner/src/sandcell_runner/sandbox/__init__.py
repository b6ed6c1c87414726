"""A session's sandbox features for envd-style APIs: interactive processes and filesystem calls."""
