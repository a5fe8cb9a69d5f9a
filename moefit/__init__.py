"""moefit: serve Mixture-of-Experts models larger than the GPU, every byte explained."""

__version__ = "0.1.0"
