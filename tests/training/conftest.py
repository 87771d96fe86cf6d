"""Fixtures of the training tests."""

import pytest

from ember.training.data import prepare_token_files, stdlib_documents


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small prepared dataset of real Python source (the first stdlib files)."""
    directory = tmp_path_factory.mktemp("data")
    documents = []
    for name, text in stdlib_documents():
        documents.append((name, text))
        if sum(len(t) for _, t in documents) > 400_000:
            break
    prepare_token_files(documents, directory, val_fraction=0.1)
    return directory
