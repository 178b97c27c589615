"""Configuration and data: what a run is, read from experiment and stage files.

``schema`` (every key a file may hold), ``tomlfile`` and ``npzfile`` (reading TOML and npz files safely: bounded
nesting, no pickles, exact dtypes), ``experiment`` (the experiment model: stages, interface, run-setting checks),
``parse`` (files and tables into an ``Experiment``), ``data`` (data sources: synthetic, npz, npy, CSV),
``split`` (an experiment into one folder per party) and ``reference`` (the generated format reference).
Imports the model math and the wire's codecs; never a stage or a process.
"""
