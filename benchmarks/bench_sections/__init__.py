"""The parts of benchmarks/bench.py: its runner, its sections (A message path, B model, C memory) and its
report. Imported by bench.py only, never run on their own."""
