"""The binding fuzzer of tools/fuzz.py, by concern (see there)."""
