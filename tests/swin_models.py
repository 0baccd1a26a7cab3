"""Tiny Swin models from configs (no hub), and a dense slow reference of the windowed maps.

The reference builds, from ``docs/windowed-attention.md`` directly, each call's full ``N x N``
token map (windows scattered through the cyclic shift, padding dropped) and each patch
merging as an ``N_coarse x N_fine`` matrix, then multiplies full matrices: what the package
computes by carrying rows, at O(N^2) per layer.
"""
from __future__ import annotations

import torch

F64 = torch.float64


def hf_swin(image=32, patch=4, embed=16, depths=(2, 2), heads=(2, 2), window=4, classes=3, dtype=torch.float32,
            seed=0, version=1, **extra):
    """A tiny HF ``SwinForImageClassification`` (``version=2``: ``Swinv2ForImageClassification``)."""
    import transformers

    torch.manual_seed(seed)
    config_class, model_class = ((transformers.SwinConfig, transformers.SwinForImageClassification) if version == 1
                                 else (transformers.Swinv2Config, transformers.Swinv2ForImageClassification))
    config = config_class(image_size=image, patch_size=patch, num_channels=3, embed_dim=embed, depths=list(depths),
                          num_heads=list(heads), window_size=window, num_labels=classes, **extra)
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():  # a relative position bias that is not zero: the maps differ per position
        for module in model.modules():
            table = getattr(module, "relative_position_bias_table", None)
            if table is not None:
                table.normal_(0, 0.5)
    return model


def dense_window_map(value: torch.Tensor, geometry) -> torch.Tensor:
    """One call's stacked window maps (B, nW * q, q) as the (B, N, N) token map."""
    batch = value.shape[0]
    index = geometry.token_index(value.device)
    windows, area = geometry.num_windows, geometry.window_area
    dense = torch.zeros(batch, geometry.num_tokens, geometry.num_tokens, dtype=value.dtype)
    blocks = value.reshape(batch, windows, area, area)
    for w in range(windows):
        keys = index[w * area:(w + 1) * area]
        for qi in range(area):
            query = int(keys[qi])
            if query < 0:
                continue
            real = keys >= 0
            dense[:, query, keys[real]] += blocks[:, w, qi, real]
    return dense


def dense_merge(fine) -> torch.Tensor:
    """(N_coarse, N_fine): merged token (i, j) from its real children, each weighted 1 / count."""
    coarse = ((fine[0] + 1) // 2, (fine[1] + 1) // 2)
    matrix = torch.zeros(coarse[0] * coarse[1], fine[0] * fine[1], dtype=F64)
    for r in range(fine[0]):
        for c in range(fine[1]):
            matrix[(r // 2) * coarse[1] + c // 2, r * fine[1] + c] = 1.0
    return matrix / matrix.sum(1, keepdim=True)


def dense_rows(trace, values, layer_matrix) -> torch.Tensor:
    """The explained row through full matrices: mean over the last tokens, then per call
    (latest first) ``row @ layer_matrix(dense map)`` and ``row @ merge`` at each merging."""
    geometries = trace.layout.windows
    batch = next(v for v in values if v is not None).shape[0]
    row = torch.full((batch, 1, geometries[-1].num_tokens), 1.0 / geometries[-1].num_tokens, dtype=F64)
    for i in reversed(range(len(geometries))):
        if values[i] is not None:
            row = row @ layer_matrix(dense_window_map(values[i].to(F64), geometries[i]))
        if i > 0 and geometries[i - 1].grid != geometries[i].grid:
            row = row @ dense_merge(geometries[i - 1].grid)
    return row.squeeze(1)


def timm_swin(image=(32, 32), patch=4, embed=16, depths=(2, 2), heads=(2, 2), window=4, classes=3,
              dtype=torch.float32, seed=0, fused=None, version=1, **extra):
    """A tiny timm SwinTransformer (``fused``: force every attention's SDPA path on or off;
    ``version=2``: SwinTransformerV2, explicit attention only, its zero-initialised head randomised)."""
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    torch.manual_seed(seed)
    model_class = SwinTransformer if version == 1 else SwinTransformerV2
    model = model_class(img_size=image, patch_size=patch, embed_dim=embed, depths=depths, num_heads=heads,
                        window_size=window, num_classes=classes, drop_path_rate=0.0, **extra).to(dtype).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                parameter.normal_(0, 0.5)
            if name.startswith("head.") and version == 2:
                parameter.normal_(0, 0.5)
    if fused is not None:
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = fused
    return model
