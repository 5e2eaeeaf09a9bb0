import batchlab


def test_import_loads_openblas_first():
    assert batchlab._blas.STATUS.name.startswith("OpenBLAS"), batchlab._blas.STATUS
