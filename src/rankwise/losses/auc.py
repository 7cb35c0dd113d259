"""Placeholder: being implemented."""
AUCLoss = None  # placeholder
WilcoxonLoss = None  # placeholder
auc_slope = None  # placeholder
