"""The project's exception types: one small hierarchy so that entry points can turn them into a
clear message and a non-zero exit instead of a traceback. Problems with input data are
:class:`data_pipeline.errors.DataError` (the data pipeline owns its base)."""


class MoEError(Exception):
    """Base class for errors a user can act on."""


class ConfigError(MoEError):
    """A run config is invalid. The message lists every problem found, each naming its key."""

    def __init__(self, problems: list[str], source: str | None = None):
        # Each once: a nested section's own check and its parent's both report what they find.
        self.problems = list(dict.fromkeys(problems))
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config{where}:\n{lines}")


class CheckpointError(MoEError):
    """A checkpoint is missing, incomplete, or does not match the config."""


class DamagedCheckpointError(CheckpointError):
    """A complete checkpoint whose files are missing, truncated or unreadable."""


class TrainingError(MoEError):
    """Training cannot go on (e.g. the loss stayed non-finite for too many steps)."""


class LaunchError(MoEError):
    """A launch plan cannot be built or run."""


class ScalingError(MoEError):
    """A scaling sweep cannot be planned, run, fitted or used for a prediction."""


class EvaluationError(MoEError):
    """A downstream evaluation cannot run: the harness is not installed, a task is unknown or
    its data cannot be read, or the model's tokenizer cannot serve the task."""
