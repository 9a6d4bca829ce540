"""fanout: one verifier pass, fanned out to N DFlash draft trainers.

Start with `./dev.sh demo` (README). The package is flat, one noun per module;
data flows data → producer → store/coordinator → consumer → train, and nothing
upstream imports anything downstream. Importing `fanout` is cheap (no torch).
"""

__version__ = "0.1.0"
