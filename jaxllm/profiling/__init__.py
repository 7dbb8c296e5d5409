"""Device timing helpers and the Pallas kernel benchmark behind `python profile.py kernels`."""
