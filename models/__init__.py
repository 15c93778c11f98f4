"""Models built on cachedarrays: compute backends (NumPy, oneDNN), CNNs and DLRM."""
