"""Releases: the record, the version label of results, and comparison through container images."""
