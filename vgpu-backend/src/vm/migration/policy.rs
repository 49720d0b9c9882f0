//! A migrated VM's operator policy (issue 28, item 1): weights, quotas, limits and process
//! weights belong to the destination's operator, never to the stream. The source still
//! writes its weight and VRAM quota into the full state (the format keeps them); the
//! destination keeps its own configured or API-set values for every one of them and
//! reports what the stream claimed ([`StreamPolicy`], `GET /api/v1/vms/{name}/migration`).
//! Limits are enforced on the stream's objects by the same handlers as a guest's requests;
//! process weight hints live in the destination's scheduler, keyed by VM name, and the
//! stream carries none.

use vgpu_protocol::migration::VmRecord;

/// What a loaded stream claimed beside what this host applies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamPolicy {
    /// This host's weight of the VM (applied).
    pub weight: u32,
    /// This host's VRAM quota of the VM (applied).
    pub vram_quota: u64,
    /// The weight the stream carried (ignored).
    pub stream_weight: u32,
    /// The VRAM quota the stream carried (ignored).
    pub stream_vram_quota: u64,
}

impl StreamPolicy {
    /// The policy of a VM whose host applies `weight` and `vram_quota`, loaded from a
    /// stream whose VM record is `rec`.
    pub fn new(weight: u32, vram_quota: u64, rec: &VmRecord) -> Self {
        StreamPolicy {
            weight,
            vram_quota,
            stream_weight: rec.weight,
            stream_vram_quota: rec.vram_quota,
        }
    }

    /// The fields where the stream differs from this host (each one ignored).
    pub fn ignored(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.stream_weight != self.weight {
            out.push("weight");
        }
        if self.stream_vram_quota != self.vram_quota {
            out.push("vram_quota");
        }
        out
    }

    /// One line for the operator, e.g. "policy from the destination (weight 100, VRAM
    /// quota 536870912 bytes); stream claimed weight 10000, ignored".
    pub fn note(&self) -> String {
        let mut claimed = Vec::new();
        if self.stream_weight != self.weight {
            claimed.push(format!("weight {}", self.stream_weight));
        }
        if self.stream_vram_quota != self.vram_quota {
            claimed.push(format!("VRAM quota {} bytes", self.stream_vram_quota));
        }
        let head = format!(
            "policy from the destination (weight {}, VRAM quota {} bytes)",
            self.weight, self.vram_quota
        );
        if claimed.is_empty() {
            format!("{head}; the stream's agrees")
        } else {
            format!("{head}; stream claimed {}, ignored", claimed.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_note_names_every_field_the_stream_got_wrong() {
        let rec = VmRecord {
            weight: 10_000,
            vram_quota: 1 << 40,
            ..VmRecord::default()
        };
        let p = StreamPolicy::new(100, 512 << 20, &rec);
        assert_eq!(p.ignored(), vec!["weight", "vram_quota"]);
        assert_eq!(
            p.note(),
            "policy from the destination (weight 100, VRAM quota 536870912 bytes); \
             stream claimed weight 10000, VRAM quota 1099511627776 bytes, ignored"
        );
        let same = StreamPolicy::new(10_000, 1 << 40, &rec);
        assert!(same.ignored().is_empty());
        assert!(same.note().ends_with("the stream's agrees"));
    }
}
