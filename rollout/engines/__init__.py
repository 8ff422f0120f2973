"""Engines: build commands, start, watch and stop SGLang servers (local processes or Ray actors)."""
