"""Data sources: built-in datasets are fixed or reproducible, user files round-trip, and bad data is a UserError."""

import h5py
import numpy as np
import pytest
import zarr

from dptrain.data import DATASET_NAMES, Dataset, load_dataset
from dptrain.errors import UserError


def arrays(ds: Dataset):
    return [t.to_numpy() for t in (ds.x_train, ds.y_train, ds.x_test, ds.y_test)]


def same(a: Dataset, b: Dataset) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(arrays(a), arrays(b)))


# --------------------------------------------------------------------- built-in


def test_digits_shapes_and_fixed_split():
    ds = load_dataset("digits", seed=0)
    assert ds.x_train.shape == (1437, 1, 8, 8) and ds.x_test.shape == (360, 1, 8, 8)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.task == "classification" and ds.num_classes == ds.num_outputs == 10
    assert ds.input_shape == (1, 8, 8)
    x = ds.x_train.to_numpy()
    assert x.min() >= 0 and x.max() <= 1
    assert same(ds, load_dataset("digits", seed=5))


def test_digits_are_scikit_learns_digits_and_split_read_without_importing_it():
    # dptrain reads the file scikit-learn ships and splits it itself (importing scikit-learn
    # costs each process about a second); the result must be what scikit-learn gives.
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x, y = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), bunch.target.astype(np.int64)
    train, test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=y)
    got = arrays(load_dataset("digits"))
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, (x[train], y[train], x[test], y[test])))
    code = "import sys; from dptrain.data import load_dataset; load_dataset('digits'); print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_stratified_split_is_scikit_learns_train_test_split(seed):
    from sklearn.model_selection import train_test_split

    from dptrain.data.sources import stratified_split

    rng = np.random.default_rng(seed)
    for classes, n, test_size in ((10, 1797, 0.2), (3, 50, 0.3), (7, 101, 0.25), (2, 9, 0.5)):
        y = rng.integers(classes, size=n)
        y[:classes * 2] = np.repeat(np.arange(classes), 2)  # every class at least twice, as scikit-learn needs
        expected = train_test_split(np.arange(n), test_size=test_size, random_state=seed, stratify=y)
        got = stratified_split(y, test_size, seed)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected)), (classes, n, test_size)


def test_mnist1d_is_the_packages_generated_dataset_with_its_split():
    from mnist1d.data import get_dataset_args, make_dataset

    expected = make_dataset(get_dataset_args())
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    ds = load_dataset("mnist1d", seed=3)
    assert np.array_equal(np.random.get_state()[1], before)  # the package's global seeding is undone
    x, y, x_test, y_test = arrays(ds)
    assert x.shape == (4000, 1, 40) and x_test.shape == (1000, 1, 40)
    assert x.dtype == np.float32 and y.dtype == y_test.dtype == np.int64
    assert np.array_equal(x[:, 0], expected["x"].astype(np.float32))
    assert np.array_equal(x_test[:, 0], expected["x_test"].astype(np.float32))
    assert np.array_equal(y, expected["y"]) and np.array_equal(y_test, expected["y_test"])
    assert ds.task == "classification" and ds.num_classes == 10 and ds.input_shape == (1, 40)
    assert same(ds, load_dataset("mnist1d", seed=0))


def test_mnist1d_without_the_package_is_one_sentence_naming_pip_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mnist1d", None)  # import mnist1d now raises ImportError
    monkeypatch.delitem(sys.modules, "mnist1d.data", raising=False)
    with pytest.raises(UserError, match=r"^dataset mnist1d needs the mnist1d package; install it with: "
                                        r"pip install mnist1d$"):
        load_dataset("mnist1d")
    with pytest.raises(UserError, match="--samples 100 applies only to synthetic data sets, not to mnist1d"):
        load_dataset("mnist1d", samples=100)


def test_digits_rejects_samples():
    with pytest.raises(UserError, match="--samples 100 applies only to synthetic"):
        load_dataset("digits", samples=100)


def test_synthetic_images_are_reproducible_and_differ_across_seeds():
    kwargs = dict(samples=200, image_size=12, channels=2, classes=4)
    ds = load_dataset("synthetic-images", seed=1, **kwargs)
    assert ds.x_train.shape == (160, 2, 12, 12) and ds.x_test.shape == (40, 2, 12, 12)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.num_classes == 4 and ds.input_shape == (2, 12, 12)
    labels = np.concatenate([ds.y_train.to_numpy(), ds.y_test.to_numpy()])
    assert set(labels) == {0, 1, 2, 3}
    assert same(ds, load_dataset("synthetic-images", seed=1, **kwargs))
    assert not same(ds, load_dataset("synthetic-images", seed=2, **kwargs))


def test_synthetic_images_classes_are_separable_by_their_templates():
    ds = load_dataset("synthetic-images", seed=0, samples=400, image_size=8, classes=3)
    x, y = ds.x_train.to_numpy(), ds.y_train.to_numpy()
    means = np.stack([x[y == c].mean(axis=0) for c in range(3)])
    assert means.std(axis=0).mean() > 0.05


def test_synthetic_regression_targets_in_unit_interval():
    ds = load_dataset("synthetic-regression", seed=0, samples=1000, features=5)
    assert ds.task == "regression" and ds.num_classes is None and ds.num_outputs == 1
    assert ds.x_train.shape == (800, 5) and ds.y_train.shape == (800, 1)
    y = np.concatenate([ds.y_train.to_numpy(), ds.y_test.to_numpy()])
    assert y.dtype == np.float32 and y.min() > 0 and y.max() < 1 and y.std() > 0.1
    assert same(ds, load_dataset("synthetic-regression", seed=0, samples=1000, features=5))
    assert not same(ds, load_dataset("synthetic-regression", seed=1, samples=1000, features=5))


def test_block_size_is_passed_on():
    ds = load_dataset("synthetic-regression", samples=500, block_size=64)
    assert ds.x_train.block_size == 64 and ds.x_train.block_lengths[0] == 64


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="digit"), "unknown dataset 'digit'; did you mean 'digits'\\? valid names are digits"),
        (dict(name="imagenet"), "unknown dataset 'imagenet'; valid names are"),
        (dict(name=None), "no data given"),
        (dict(name="synthetic-images", samples=0), "samples 0 is invalid"),
        (dict(name="synthetic-images", classes=1), "classes 1 is invalid"),
        (dict(name="synthetic-regression", test_fraction=1.0), "test_fraction 1.0 is invalid"),
        (dict(name="synthetic-regression", samples=2, test_fraction=0.1), "leaves 0 test"),
        (dict(name="digits", data_path="d.npz"), "--dataset digits is built in"),
    ],
)
def test_bad_arguments_are_user_errors(kwargs, message):
    name = kwargs.pop("name")
    with pytest.raises(UserError, match=message):
        load_dataset(name, **kwargs)


def test_names_are_listed():
    assert DATASET_NAMES == ("digits", "mnist1d", "synthetic-images", "synthetic-regression")


# ------------------------------------------------------------------- user files


def save(path, **named):
    """Write named arrays in the format given by the path: .npz, .h5, .zarr, or a directory of .npy."""
    suffix = path.suffix
    if suffix == ".npz":
        np.savez(path, **named)
    elif suffix == ".h5":
        with h5py.File(path, "w") as f:
            for key, value in named.items():
                f[key] = value
    elif suffix == ".zarr":
        group = zarr.open_group(str(path), mode="w")
        for key, value in named.items():
            group.create_array(key, data=value)
    else:
        path.mkdir()
        for key, value in named.items():
            np.save(path / f"{key}.npy", value)
    return str(path)


FORMATS = ["d.npz", "d.h5", "d.zarr", "npydir"]


@pytest.mark.parametrize("filename", FORMATS)
def test_file_round_trip_with_explicit_test_set(tmp_path, filename):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((30, 2, 3)).astype(np.float32), np.arange(30) % 3
    x_test, y_test = rng.standard_normal((6, 2, 3)).astype(np.float32), np.arange(6) % 3
    ds = load_dataset(None, data_path=save(tmp_path / filename, x=x, y=y, x_test=x_test, y_test=y_test), block_size=8)
    for got, want in zip(arrays(ds), (x, y, x_test, y_test)):
        assert np.array_equal(got, want)
    assert ds.task == "classification" and ds.num_classes == 3 and ds.input_shape == (2, 3)
    assert ds.name == (tmp_path / filename).stem
    assert ds.x_train.block_size == 8


@pytest.mark.parametrize("filename", FORMATS)
def test_file_split_is_deterministic_from_seed_and_keeps_pairs(tmp_path, filename):
    x = np.arange(50, dtype=np.float32).reshape(50, 1) * 2
    y = np.arange(50, dtype=np.float32)
    path = save(tmp_path / filename, x=x, y=y)
    ds = load_dataset("mine", data_path=path, seed=3, test_fraction=0.2)
    assert ds.name == "mine" and ds.task == "regression" and ds.num_outputs == 1
    assert len(ds.x_train) == 40 and len(ds.x_test) == 10
    train, test = ds.y_train.to_numpy(), ds.y_test.to_numpy()
    assert np.array_equal(np.sort(np.concatenate([train, test])), y)
    assert np.all(np.diff(train) > 0), "training samples keep file order"
    assert np.array_equal(ds.x_train.to_numpy()[:, 0], train * 2)
    assert same(ds, load_dataset("mine", data_path=path, seed=3))
    assert not same(ds, load_dataset("mine", data_path=path, seed=4))


def test_file_data_is_read_lazily(tmp_path):
    path = save(tmp_path / "d.h5", x=np.zeros((100, 4), np.float32), y=np.zeros(100, np.float32))
    ds = load_dataset(None, data_path=path, block_size=10)
    scanned = ds.x_train.rows_read  # the NaN check reads every row once
    ds.x_train.shard(0, 4).to_numpy()
    assert ds.x_train.rows_read - scanned == 20


def test_regression_with_2d_targets(tmp_path):
    path = save(tmp_path / "d.npz", x=np.zeros((10, 3)), y=np.zeros((10, 4)))
    assert load_dataset(None, data_path=path).num_outputs == 4


BAD_FILES = [
    ("missing y", dict(x=np.zeros((5, 2)), labels=np.zeros(5, int)), "has no array 'y'; it holds: (labels, x|x, labels)"),
    ("length mismatch", dict(x=np.zeros((5, 2)), y=np.zeros(4, int)), "5 samples in 'x' but 4 in 'y'"),
    ("nan in x", dict(x=np.array([[np.nan], [1], [np.inf]]), y=np.arange(3)), "'x' .* has 2 NaN or infinite"),
    ("nan in y", dict(x=np.zeros((3, 1)), y=np.array([0.5, np.nan, 0.1])), "'y' .* has 1 NaN or infinite"),
    ("negative label", dict(x=np.zeros((3, 1)), y=np.array([0, -2, 1])), "negative class label -2"),
    (
        "test label out of range",
        dict(x=np.zeros((4, 1)), y=np.array([0, 1, 1, 0]), x_test=np.zeros((2, 1)), y_test=np.array([0, 5])),
        "'y_test' .* has class label 5 but 'y' only goes up to 1",
    ),
    ("empty", dict(x=np.zeros((0, 2)), y=np.zeros(0, int)), "'x' .* is empty"),
    ("y with 3 dims", dict(x=np.zeros((3, 1)), y=np.zeros((3, 2, 2))), r"'y' .* has shape \(3, 2, 2\)"),
    (
        "x_test shape",
        dict(x=np.zeros((3, 2)), y=np.arange(3), x_test=np.zeros((2, 5)), y_test=np.arange(2)),
        r"'x_test' .* per-sample shape \(5,\) but 'x' has \(2,\)",
    ),
    ("x_test alone", dict(x=np.zeros((3, 2)), y=np.arange(3), x_test=np.zeros((2, 2))), "'x_test' but no 'y_test'"),
    ("single class", dict(x=np.zeros((3, 2)), y=np.zeros(3, int)), "only class 0"),
    ("2-d int labels", dict(x=np.zeros((3, 2)), y=np.zeros((3, 1), int)), "integer class labels must be 1-D"),
]


@pytest.mark.parametrize("case, named, message", BAD_FILES, ids=[case for case, _, _ in BAD_FILES])
@pytest.mark.parametrize("filename", ["d.npz", "d.h5"])
def test_bad_files_are_user_errors_naming_the_value(tmp_path, filename, case, named, message):
    path = save(tmp_path / filename, **named)
    with pytest.raises(UserError, match=message) as info:
        load_dataset(None, data_path=path)
    assert filename in str(info.value)


def test_labels_that_are_not_numbers_are_user_errors(tmp_path):
    path = save(tmp_path / "d.npz", x=np.zeros((3, 2)), y=np.array(["a", "b", "c"]))
    with pytest.raises(UserError, match="'y' .* has dtype <U1; use an integer or floating dtype"):
        load_dataset(None, data_path=path)


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(UserError, match="'.*nothing.npz' does not exist"):
        load_dataset(None, data_path=str(tmp_path / "nothing.npz"))
    np.save(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(UserError, match="put x.npy and y.npy"):
        load_dataset(None, data_path=str(tmp_path / "x.npy"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="'.*empty' is empty; --data DIR takes a folder of images .* or a folder holding x.npy and y.npy"):
        load_dataset(None, data_path=str(tmp_path / "empty"))
    (tmp_path / "d.csv").write_text("1\n")
    with pytest.raises(UserError, match="unsupported extension"):
        load_dataset(None, data_path=str(tmp_path / "d.csv"))
