"""Byte units, defined once: every figure zero_bench prints or stores in MiB / GiB uses these."""
MiB = 2**20
GiB = 2**30
