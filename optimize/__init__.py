"""`mha-serving optimize`: from a trained model to the cheapest head configuration that meets an SLO."""
