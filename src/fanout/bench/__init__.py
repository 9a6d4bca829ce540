"""Measuring whole runs: the benchmark harness, its reports, telemetry and the demo.

Owns: the benchmark config (config), `fanout bench` (bench), what a scenario ran
(scenario), each scenario's numbers and validity (metrics), report.json / .md from a run (report) and its plots (plots),
NVML and process telemetry (telemetry), `fanout demo` (demo) and the tiny assets it
and the tests build (assets).

May import: produce, train, status, coord, store, decode, data, families, model, ops
and the core; runs the roles as separate processes (`python -m fanout.cli`), never imports cli.
"""
