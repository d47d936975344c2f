"""The main job, `torchpipedream train`: profile → plan → launch → train → report.

`torchpipedream train` with no arguments profiles the default example model (a CNN whose
weights sit mostly in its wide fully-connected head), plans it for one worker per core,
launches the workers, trains on the digits images bundled with the package (a fixed split)
with a progress bar, and writes a report, the measured timeline picture, a Chrome trace and
the final checkpoint into the output directory.

One module per job, so that the command line can read the options without importing torch:

========================  ============================================================
``train.config``          :class:`TrainConfig`, :class:`TrainError`, option checks (no torch)
``train.inputs``          the model, data, loss and optimizer a configuration names
``train.preparation``     :func:`prepare`: options checked, profile, plan, prediction
``train.resume``          checkpoint directories, ``--resume``, torchrun restarts
``train.worker``          one rank's training loop
``train.outputs``         the files a run writes and the end-of-run report
``train.job``             :func:`run`: on this computer's cores or under torchrun
========================  ============================================================
"""

from __future__ import annotations

from .config import OPTIMIZERS, TrainConfig, TrainError

__all__ = ["TrainConfig", "TrainError", "OPTIMIZERS"]
