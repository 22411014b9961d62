"""Every internal of accelerate hf_parallel uses, and why.

- ``init_empty_weights(include_buffers=False)``: the model built on the meta device with its buffers
  (RoPE tables) real, as transformers builds it.
- The data loader's ``DeviceMesh``: the Trainer prepares its loader through accelerate, which hands a
  batch per rank unless its state holds a mesh saying which ranks share one (a model replica's TP,
  SP and PP ranks). accelerate fills that mesh only from its own ``ParallelismConfig``, which it
  refuses on CPU and which would make it shard the model again, so hf_parallel sets it.
"""

from __future__ import annotations

from . import Seam

INIT_EMPTY_WEIGHTS = Seam("accelerate", "accelerate:init_empty_weights", "(the meta build, buffers real)",
                          parameters=("include_buffers",))  # fmt: skip
STATE_MESH = Seam("accelerate", "accelerate.state:AcceleratorState.__init__", "(where the batch mesh is kept)",
                  reads=("device_mesh",))  # fmt: skip
LOADER_MESH = Seam("accelerate", "accelerate.accelerator:Accelerator.prepare_data_loader",
                   "(it hands the mesh to the loader, which gives a replica's ranks the same rows)",
                   reads=("_prepare_device_mesh",))  # fmt: skip
MESH_OF_STATE = Seam("accelerate", "accelerate.accelerator:Accelerator._prepare_device_mesh",
                     "(the loader's mesh is the state's)", reads=("torch_device_mesh",))  # fmt: skip
STATE_MESH_READ = Seam("accelerate", "accelerate.accelerator:Accelerator.torch_device_mesh",
                       "(the loader's mesh is the state's)", reads=("device_mesh",))  # fmt: skip


def init_empty_weights():
    """A context in which modules get meta parameters and real buffers."""
    return INIT_EMPTY_WEIGHTS.get()(include_buffers=False)


def set_batch_mesh(accelerator, device_mesh) -> None:
    """``accelerator``'s data loaders give the ranks of one row of ``device_mesh`` the same batch."""
    STATE_MESH.get(), LOADER_MESH.get(), MESH_OF_STATE.get(), STATE_MESH_READ.get()
    if accelerator.state.device_mesh is None:
        accelerator.state.device_mesh = device_mesh
