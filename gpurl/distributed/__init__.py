"""Multi-process runtime, meshes, placement and shardings."""
