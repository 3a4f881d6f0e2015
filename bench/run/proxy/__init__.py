"""Proxy mode: one rank of a large layout run for real here (`run`: the run and its result; `scale`: its sizes; `measure`: the rank's measured steps; `rank`: the rank itself inside a fake world)."""
