"""Local math kernels of every layer family: no distribution, no communication.

Arrays are NumPy or CuPy (the module is taken from the arguments), float32 or float64, channels-first
(``(N, C, H, W)`` / ``(N, C, D, H, W)``). Windowed kernels (conv, pooling) work on the window the
distributed layer hands them — halo and padding included — and return gradients for that window.
"""
from ._geometry import KernelShapeError
from .activation import (dropout_backward, dropout_forward, dropout_mask, leaky_relu_backward,
                         leaky_relu_forward, relu_backward, relu_forward)
from .batchnorm import (bn_add_param_grads, bn_backward, bn_backward_data, bn_backward_data_summed,
                        bn_backward_params, bn_backward_sums, bn_forward, bn_local_stats, bn_local_sums,
                        bn_mean_var, bn_train_forward)
from .conv import ConvGeometry, conv_backward_bias, conv_backward_data, conv_backward_filter, conv_forward
from .padding import crop_spatial, pad_spatial
from .fc import fc_backward_bias, fc_backward_data, fc_backward_filter, fc_forward
from .loss import (accuracy_counts, cross_entropy, downsample_labels_any, iou, iou_counts,
                   pixel_cross_entropy, predictions, softmax_cross_entropy)
from .pool import avg_pool_backward, avg_pool_forward, max_pool_backward, max_pool_forward

__all__ = [
    "KernelShapeError", "ConvGeometry",
    "conv_forward", "conv_backward_data", "conv_backward_filter", "conv_backward_bias", "pad_spatial",
    "crop_spatial",
    "max_pool_forward", "max_pool_backward", "avg_pool_forward", "avg_pool_backward",
    "bn_local_stats", "bn_mean_var", "bn_forward", "bn_backward", "bn_backward_data", "bn_backward_params",
    "bn_local_sums", "bn_train_forward", "bn_add_param_grads", "bn_backward_sums", "bn_backward_data_summed",
    "relu_forward", "relu_backward", "leaky_relu_forward", "leaky_relu_backward",
    "dropout_mask", "dropout_forward", "dropout_backward",
    "fc_forward", "fc_backward_data", "fc_backward_filter", "fc_backward_bias",
    "cross_entropy", "softmax_cross_entropy", "pixel_cross_entropy", "downsample_labels_any",
    "predictions", "accuracy_counts", "iou_counts", "iou",
]
