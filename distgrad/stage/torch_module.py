"""Your own PyTorch module as a stage: ``module = "pkg.mod:factory"`` imported from the folder of the file that
names it (each stage folder's modules kept apart in one process), called after ``torch.manual_seed`` so every
process draws the same initial values, and checked (``build_module``); a vertical label owner's own bottom put
under it (``_with_own_bottom``).

Part of ``distgrad.stage.torch_stage``. Errors are ``ConfigError``s naming the stage, the module path and, when
the user's code raised, its file and line (``_raised_at``: this file's own frames are not the user's).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from distgrad.config.experiment import Experiment, StageSpec
from distgrad.errors import ConfigError
from distgrad.model.nn import build_model
from distgrad.stage.torch_layers import _torch_bottom
from distgrad.stage.torch_tensors import _Param


def _inside(module: Any, folder: Path) -> bool:
    """True when ``module`` (a file, a package or a namespace package) was loaded from ``folder``."""
    origins = [getattr(module, "__file__", None), *getattr(module, "__path__", [])]
    return any(origin is not None and Path(origin).resolve().is_relative_to(folder) for origin in origins)


# The modules imported from a stage file's folder (its module and whatever of that folder its code imports), by
# name: the folder they came from. Another folder's stage must not find them in sys.modules under that name.
_FOLDER_MODULES: dict[str, Path] = {}
_FOLDER_LOCK = threading.RLock()        # sys.path and sys.modules are the process's: one stage folder at a time


@contextlib.contextmanager
def _stage_folder(folder: Path) -> Iterator[None]:
    """Run an import of a stage's code, or its factory, with ``folder`` first on ``sys.path`` and without the
    modules another stage folder put in ``sys.modules`` (two parties' ``model.py``, or the ``helpers.py`` each
    one's imports, in one process: ``--in-process``, the launcher's check of every stage, the API); the modules
    this folder's code imports are recorded as its own. Stages built before keep the modules they hold."""
    with _FOLDER_LOCK:
        for name, origin in list(_FOLDER_MODULES.items()):
            if origin != folder:
                sys.modules.pop(name, None)
                del _FOLDER_MODULES[name]
        before = set(sys.modules)
        sys.path.insert(0, str(folder))
        try:
            yield
        finally:
            sys.path.remove(str(folder))
            for name in set(sys.modules) - before:
                if _inside(sys.modules[name], folder):
                    _FOLDER_MODULES[name] = folder


def _import_module(path: str, base_dir: Path, where: str) -> Any:
    """Import ``path`` ("pkg.mod"), from ``base_dir`` when it holds ``pkg`` (a ``.py`` or a folder), else
    from ``sys.path``. A module of the same name already imported from elsewhere is replaced in
    ``sys.modules`` (two stage files may each have their own ``model.py``, and each its own modules that
    it imports: ``_stage_folder``)."""
    top = path.split(".")[0]
    folder = base_dir.resolve()
    local = (folder / f"{top}.py").is_file() or (folder / top).is_dir()
    try:
        if not local:
            return importlib.import_module(path)
        with _stage_folder(folder):
            stale = [name for name, module in list(sys.modules.items())
                     if (name == top or name.startswith(top + ".")) and not _inside(module, folder)]
            for name in stale:
                del sys.modules[name]
            return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name is not None and path != e.name and not path.startswith(e.name + "."):
            raise ConfigError(f"{where}: importing {path!r} failed: it imports {e.name!r}, which is not installed "
                              f"({e})") from e
        raise ConfigError(f"{where}: no module {path!r}: put {path.replace('.', '/')}.py next to the file that "
                          f"names it ({folder}), or install it or add its folder to PYTHONPATH") from e
    except Exception as e:       # the user's module raised anything while being imported
        raise ConfigError(f"{where}: importing {path!r} failed: {type(e).__name__}: {e}"
                          f"{_raised_at(e, folder if local else None)}") from e


def _raised_at(error: BaseException, folder: Path | None) -> str:
    """`` (at FILE line N)``: the innermost line of ``error``'s traceback in the user's code: the files under
    ``folder`` (None: any file but distgrad's and Python's import machinery); nothing when there is none
    (the call itself failed: a wrong keyword argument says so). A syntax error names its file and line itself."""
    if isinstance(error, SyntaxError):
        return ""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if (Path(frame.filename).resolve().is_relative_to(folder) if folder is not None
                  else not frame.filename.startswith("<") and Path(frame.filename).resolve() != Path(__file__).resolve())]
    return f" (at {frames[-1].filename} line {frames[-1].lineno})" if frames else ""


def build_module(spec: StageSpec, seed: int, overrides: Mapping[str, float] | None = None) -> nn.Module:
    """The ``torch.nn.Module`` a stage's ``module = "pkg.mod:factory"`` makes, on the CPU, float32, with the
    ``overrides`` (``--init``) that name its parameters applied.

    The factory is called with ``module_args`` as keyword arguments after
    ``torch.manual_seed(spec.init_seed(seed))`` (inside ``torch.random.fork_rng``:
    the caller's random state is left as it was), so every process draws the
    same initial values. Raises ``ConfigError`` naming the module path for an
    import that fails, a missing or uncallable factory, a factory that raises
    or returns something other than a module, or parameters other than float32
    (the file and line of the user's code that raised, when it did).
    """
    assert spec.module is not None, f"stage {spec.name} has no module"
    path, function = spec.module.split(":")
    where = f"stage {spec.name!r} (module {spec.module!r})"
    imported = _import_module(path, spec.base_dir, where)
    folder = spec.base_dir.resolve()         # the user's code, when the module was found there
    factory = getattr(imported, function, None)
    if not callable(factory):
        public = sorted(n for n, v in vars(imported).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"{where}: {path} ({getattr(imported, '__file__', '?')}) has no function {function!r}"
                          f"{'' if factory is None else ' (it is not callable)'}; its callables: {', '.join(public) or 'none'}")
    local = _inside(imported, folder)
    with torch.random.fork_rng(devices=[]), _stage_folder(folder) if local else contextlib.nullcontext():
        torch.manual_seed(spec.init_seed(seed))
        try:
            module = factory(**spec.module_args)      # its imports find its folder's files too
        except Exception as e:       # the user's factory raised anything
            raise ConfigError(f"{where}: {function}(**{spec.module_args!r}) raised {type(e).__name__}: {e}"
                              f"{_raised_at(e, folder if local else None)}") from e
    if not isinstance(module, nn.Module):
        raise ConfigError(f"{where}: {function} returned {type(module).__name__}, not a torch.nn.Module: return the "
                          f"model itself (e.g. torch.nn.Sequential(...))")
    for name, p in module.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(f"{where}: parameter {name} is {p.dtype}; a torch stage computes in float32 (build "
                              f"the module with the default dtype, or return module.float())")
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in (overrides or {}).items():
            if name in params:
                params[name].fill_(value)
    return module


def module_param_names(exp: Experiment, name: str, seed: int, module: nn.Module | None = None) -> list[str]:
    """The parameter names of module stage ``name`` (``named_parameters``, by building its module unless
    given), and a vertical label owner's own ``bottom``'s (distgrad's names: ``own1.W``)."""
    spec = exp.spec(name)
    module = build_module(spec, seed) if module is None else module
    bottom = list(build_model(spec.bottom, spec.init_seed(seed)).params) if spec.bottom is not None else []
    return [n for n, _ in module.named_parameters()] + bottom


def _with_own_bottom(exp: Experiment, name: str, seed: int, init: Mapping[str, float], module: nn.Module,
                     params: list[_Param]) -> tuple[nn.Module, list[_Param]]:
    """A module stage of a vertical label owner with its own ``bottom`` (numpy layer tables, built in torch
    from the numpy build's values for ``seed`` and ``init``): ``OwnBottomModule`` over ``module``, and the
    parameters, the bottom's under distgrad's names (``own1.W``) first, then the module's as they were."""
    model = exp.bottom_layer(name, seed)
    for key, value in init.items():
        if key in model.bottom.params:
            model.bottom.params[key][...] = value
    joined, names = _torch_bottom(model, module)
    return joined, [_Param(dg_name, joined.get_parameter(attr), transposed)
                    for dg_name, attr, transposed in names] + params
