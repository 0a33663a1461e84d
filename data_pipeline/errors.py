"""The data pipeline's one exception type. The pipeline stands on its own (it imports nothing from
the model or training code), so it owns this base; command lines turn it into a clear message and
a non-zero exit like the model's own errors."""


class DataError(Exception):
    """Input data (a source, a shard, a manifest, a tokenizer) is missing or malformed. The
    message names the file, source or key."""


def corrupt(where: object, what: str, found: str, expected: str) -> DataError:
    """A file or object whose SHA-256 is not the manifest's: both digests, and the way out."""
    return DataError(
        f"{where}: corrupt {what}: its SHA-256 is {found}, the manifest's is "
        f"{expected}; copy or prepare the data again"
    )
