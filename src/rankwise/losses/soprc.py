"""Placeholder: being implemented."""
APLoss = None  # placeholder
SemiVarianceRegularizer = None  # placeholder
SOPRCLoss = None  # placeholder
