"""sixfold: serve recommendation models on a host CPU plus N accelerator cards.

The one import name of the distribution. Its sub-packages are the repository's root folders,
mapped in by setup.py (a wheel holds them under ``sixfold/``), in the order a request meets them:

    sixfold.models       the model zoo, signatures and synthetic data      (imports nothing of ours)
    sixfold.backends     the device layer: Backend API, specs, registry    (the vendor plug-in point)
    sixfold.partitioner  model -> plan: cut, placement, pricing, precision, tables
    sixfold.server       KServe v2 gRPC/REST serving: transport -> scheduling -> execution
    sixfold.loadgen      production-like traffic against any KServe v2 server
    sixfold.simulate     the server's own scheduling code in virtual time

docs/architecture.md walks one request and one plan through these.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

# A source checkout with only its root on sys.path (no install): the sub-packages are the
# checkout's root folders beside this one. An installed sixfold holds them in this folder.
_here = _Path(__file__).resolve().parent
if not (_here / "server").is_dir() and (_here.parent / "server" / "__init__.py").is_file():
    __path__.append(str(_here.parent))  # noqa: F821 (a package's own __path__)
del _Path, _here
