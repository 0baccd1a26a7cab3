"""Metrics that perturb pixels: pixel / region flipping, positive-negative perturbation, RISE
deletion / insertion, ROAD, relevance gain over images, segmentation and class specificity.
"""
