//! One attention call from the engine's side: a model computing on the host with a GPU
//! backend has its tensors moved to the device and the output moved back. And a step's
//! decoder plans, one per group of layers that share a plan.

use pagedattn::{
    AttentionConfig, AttentionImpl, AttnType, Backend, Device, Inputs, KvCache, Plan, Tensor,
    Workspace,
};

use crate::Result;

/// `t` moved to `device`, or `None` where it is there already.
fn moved(t: &Tensor, device: Device) -> Result<Option<Tensor>> {
    Ok(if t.device() == device {
        None
    } else {
        Some(t.to_device(device)?)
    })
}

/// Whether layers of configs `a` and `b` share a plan: the same attention type, heads, head
/// size, window and cache dtype (they may differ in scale, slopes, soft cap and fp8 scales;
/// docs/semantics.md, "A step"). Windowed and global layers of one model do not.
pub(crate) fn same_plan(a: &AttentionConfig, b: &AttentionConfig) -> bool {
    let key = |c: &AttentionConfig| {
        (
            c.attn_type(),
            c.num_heads(),
            c.num_kv_heads(),
            c.head_size(),
            c.sliding_window(),
            c.kv_cache_dtype(),
        )
    };
    key(a) == key(b)
}

/// A step's decoder plans: one per group of decoder layers that share a plan ([`same_plan`]),
/// each kept with the first layer of its group.
#[derive(Default)]
pub(crate) struct DecoderPlans(Vec<(usize, Plan)>);

impl DecoderPlans {
    /// Plans each group of `layers`' decoder layers once, by `plan` of the group's first layer.
    pub(crate) fn new(
        layers: &[AttentionConfig],
        mut plan: impl FnMut(usize) -> Result<Plan>,
    ) -> Result<Self> {
        let mut plans: Vec<(usize, Plan)> = Vec::new();
        for (layer, c) in layers.iter().enumerate() {
            let planned = plans.iter().any(|(first, _)| same_plan(&layers[*first], c));
            if c.attn_type() == AttnType::Decoder && !planned {
                plans.push((layer, plan(layer)?));
            }
        }
        Ok(DecoderPlans(plans))
    }

    /// The plan of a layer of `config` (`layers` as given to [`DecoderPlans::new`]), if its
    /// group was planned.
    pub(crate) fn of(&self, layers: &[AttentionConfig], config: &AttentionConfig) -> Option<&Plan> {
        self.0
            .iter()
            .find(|(first, _)| same_plan(&layers[*first], config))
            .map(|(_, plan)| plan)
    }

    /// Every plan.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Plan> {
        self.0.iter().map(|(_, plan)| plan)
    }
}

/// One attention call on `backend`: a model computing on the host with a GPU backend has its
/// tensors moved to the device and the output moved back.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_attention(
    backend: &dyn Backend,
    attention: &dyn AttentionImpl,
    plan: &Plan,
    workspace: &mut Workspace,
    query: &Tensor,
    kv: Option<(&Tensor, &Tensor)>,
    cache: Option<&mut KvCache>,
    output: &mut Tensor,
) -> Result<()> {
    let device = backend.device();
    let q_moved = moved(query, device)?;
    let query = q_moved.as_ref().unwrap_or(query);
    let kv_moved = match kv {
        Some((k, v)) => Some((moved(k, device)?, moved(v, device)?)),
        None => None,
    };
    let kv = kv
        .zip(kv_moved.as_ref())
        .map(|((k, v), (mk, mv))| (mk.as_ref().unwrap_or(k), mv.as_ref().unwrap_or(v)));
    let inputs = Inputs::new(query).with_cache_opt(cache);
    let inputs = match kv {
        Some((k, v)) => inputs.with_kv(k, v),
        None => inputs,
    };
    if output.device() == device {
        attention.forward_into(plan, workspace, inputs, output)?;
    } else {
        let mut out = Tensor::zeros_on(device, output.dtype(), output.shape())?;
        attention.forward_into(plan, workspace, inputs, &mut out)?;
        output.copy_from(&out)?;
    }
    Ok(())
}

/// `write_kv` of `key`/`value` into `cache` on `backend` (moved to its device if needed).
pub(crate) fn write_kv(
    backend: &dyn Backend,
    attention: &dyn AttentionImpl,
    plan: &Plan,
    key: &Tensor,
    value: &Tensor,
    cache: &mut KvCache,
) -> Result<()> {
    let device = backend.device();
    let (mk, mv) = (moved(key, device)?, moved(value, device)?);
    attention.write_kv(
        plan,
        mk.as_ref().unwrap_or(key),
        mv.as_ref().unwrap_or(value),
        cache,
    )?;
    Ok(())
}
