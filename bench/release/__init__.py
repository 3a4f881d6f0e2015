"""Releases: the record, the version label of results, and the git queries both share."""
