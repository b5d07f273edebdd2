"""Benchmarks: the datasets × methods × sweep harness and its report, the speed-of-light
bound, draft-vs-verify cost, the `transformers` peer and timing helpers."""

from dspec.bench.draft_cost import draft_vs_verify
from dspec.bench.harness import run_benchmark
from dspec.bench.hf_peer import time_hf_generate
from dspec.bench.report import render_results_section
from dspec.bench.sol import sol_bound, speed_of_light
from dspec.bench.timing import median_time, median_times

__all__ = ['draft_vs_verify', 'median_time', 'median_times', 'render_results_section',
           'run_benchmark', 'sol_bound', 'speed_of_light', 'time_hf_generate']
