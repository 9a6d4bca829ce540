"""Measuring whole runs: the benchmark harness, its reports, telemetry and the demo.

Owns: `fanout bench` (bench), report.json / .md / plots from a run (report), NVML
and process telemetry (telemetry), `fanout demo` (demo) and the tiny assets it
and the tests build (assets).

May import: produce, train, coord, store, data, model, ops and the core; runs the
roles as separate processes (`python -m fanout.cli`), never imports cli.
"""
