from comera_compile.rank_adaptation.ranker import RankAdaptation, size_coefficients

__all__ = ["RankAdaptation", "size_coefficients"]
