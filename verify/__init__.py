"""The property suite: ``pytest verify`` checks every selected implementation against the catalogue."""
