"""Byte and rate units. Values are stored in base units (bytes, seconds); these convert at the edges."""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40

GB = 10**9
TB = 10**12
