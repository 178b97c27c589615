"""The experiments the benchmark generates: the mlp split and the trivial (identity) model of section A."""

from __future__ import annotations

def _layer_toml(layer: tuple, index: int, prefix: str) -> str:
    if layer[0] == "dense":
        return f'{{ type = "dense", name = "{prefix}{index}", in = {layer[1]}, out = {layer[2]} }}'
    if layer[0] == "scale":
        return f'{{ type = "scale", name = "{prefix}{index}", size = {layer[1]}, init = 1.0 }}'
    return f'{{ type = "{layer[0]}" }}'


def mlp_toml(name: str, f: list[tuple], g: list[tuple], batch: int) -> str:
    """A classification experiment like mlp-classify with these layers and batch size."""
    def model(layers: list[tuple], prefix: str) -> str:
        return ",\n  ".join(_layer_toml(layer, i + 1, prefix) for i, layer in enumerate(layers))
    return f'''name = "{name}"
steps = 100
seed = 0
labels = "last"

[data]
kind = "synthetic_classification"
samples = {max(2048, 4 * batch)}
features = 784
classes = 10
batch = {batch}
spread = 4.0

[[stages]]
name = "f"
model = [
  {model(f, "f")},
]
optimizer = {{ type = "adam", lr = 0.001 }}

[[stages]]
name = "g"
model = [
  {model(g, "g")},
]
optimizer = {{ type = "adam", lr = 0.001 }}
loss = "softmax_cross_entropy"
'''


def trivial_toml(size_bytes: int) -> str:
    """Trivial compute over N = bytes/4 floats: an ``identity`` layer on each stage, sum of squared errors.

    No stage has a parameter, so no optimiser runs, and the identity layers
    pass arrays through without touching them. What remains per step is the
    least a split step does to its data: f makes its batch (the activation
    sent), g its target, the loss and its gradient (the array sent back), and
    both validate what they receive. (The earlier "trivial" model, one ``scale`` layer of N
    weights on each stage with SGD, spent a dozen element-wise passes over N
    floats per step on its weights, which made the large-message figures
    measure numpy, not the transport.) The ramp's delta is 0 (x = 1 every
    step), so the loss is 0 and every run stays finite.
    """
    n = max(1, size_bytes // 4)
    return f'''name = "bench-trivial-{size_bytes}"
steps = 100
seed = 0
labels = "last"

[data]
kind = "ramp"
start = 1.0
delta = 0.0
size = {n}

[[stages]]
name = "f"
model = [{{ type = "identity" }}]
optimizer = {{ type = "sgd", lr = 0.01 }}

[[stages]]
name = "g"
model = [{{ type = "identity" }}]
optimizer = {{ type = "sgd", lr = 0.01 }}
loss = "sum_squared_error"
'''
