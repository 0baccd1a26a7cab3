"""The math the methods share beyond :mod:`captum_transformers.functional`: relevancy-map updates between
streams (ICCV'21) and the exact maximum flow of attention flow.
"""
