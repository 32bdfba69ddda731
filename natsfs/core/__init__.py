"""The FUSE-free filesystem core: paths → nodes, the open-file table, invalidations (no pyfuse3 here)."""
