//! `fifo`: the front-end core both GPUs share.
//!
//! Guests drive the `sim` and the `cuda` GPU the same way: they store GP_PUT into a
//! channel's control page, and the GPU's front end fetches and decodes GP entries from the
//! channel's address space. What does not depend on how the entries then run lives here:
//! - [`control_pages`]: the memfd holding every channel's control page;
//! - [`channel_core`]: [`channel_core::ChannelCore`], which each GPU's channel contains;
//! - [`doze`]: the front end's sleep with the doorbell armed;
//! - [`fetch`]: GP fetch/decode and a LAUNCH's argument block;
//! - [`tables`]: the contexts and channels, the front end's wake-up, the VRAM bounds check,
//!   and ([`table_methods!`]) the `Gpu` methods answered from them alone.
//!
//! A GPU adds how the methods run: the sim's PFIFO and copy engine (`crate::sim`), the
//! cuda planner and streams (`crate::cuda`).

pub mod channel_core;
pub mod control_pages;
pub mod doze;
pub mod fetch;
pub mod tables;

/// The [`crate::hal::Gpu`] methods that every GPU answers the same way from its
/// [`tables::Tables`] and its contexts' address spaces. Expands inside `impl Gpu for ...`
/// of a type with a `self.shared.fifo: Tables`, a `self.space(ctx)`, a
/// `self.new_channel(ctx, cfg, sink, Option<ChannelResume>)` and a
/// `self.reported_counters(ChannelCounters)` (what the GPU shows of a channel's counters).
macro_rules! table_methods {
    () => {
        fn control_pages(&self) -> Option<$crate::hal::FdRange> {
            Some(self.shared.fifo.pages().whole())
        }

        fn page_table_bytes(&self, ctx: $crate::hal::ContextId) -> $crate::hal::Result<u64> {
            Ok(self.space(ctx)?.table_bytes())
        }

        fn map_cost(
            &self,
            ctx: $crate::hal::ContextId,
            va: u64,
            size: u64,
            page: $crate::hal::PageSize,
        ) -> $crate::hal::Result<u64> {
            Ok(self.space(ctx)?.map_cost(va, size, page))
        }

        fn create_channel(
            &self,
            ctx: $crate::hal::ContextId,
            cfg: $crate::hal::ChannelConfig,
            sink: std::sync::Arc<dyn $crate::hal::EventSink>,
        ) -> $crate::hal::Result<$crate::hal::ChannelId> {
            self.new_channel(ctx, cfg, sink, None)
        }

        fn create_channel_resumed(
            &self,
            ctx: $crate::hal::ContextId,
            cfg: $crate::hal::ChannelConfig,
            sink: std::sync::Arc<dyn $crate::hal::EventSink>,
            at: $crate::hal::ChannelResume,
        ) -> $crate::hal::Result<$crate::hal::ChannelId> {
            self.new_channel(ctx, cfg, sink, Some(at))
        }

        fn control_page(
            &self,
            ch: $crate::hal::ChannelId,
        ) -> $crate::hal::Result<$crate::hal::FdRange> {
            self.shared.fifo.control_page(ch)
        }

        fn doorbell(&self, _ch: $crate::hal::ChannelId) {
            self.shared.fifo.wake();
        }

        fn channel_counters(
            &self,
            ch: $crate::hal::ChannelId,
        ) -> $crate::hal::Result<$crate::hal::ChannelCounters> {
            self.shared
                .fifo
                .channel_counters(ch)
                .map(|c| self.reported_counters(c))
        }

        /// Every GPU notes a channel's fetches, completions and error stop in its
        /// `ChannelCore` (the shared front-end core).
        fn count_activity(
            &self,
            ch: $crate::hal::ChannelId,
            counter: std::sync::Arc<$crate::hal::ActivityCounter>,
        ) -> $crate::hal::Result<bool> {
            self.shared.fifo.count_activity(ch, counter)
        }

        fn channel_error(
            &self,
            ch: $crate::hal::ChannelId,
        ) -> $crate::hal::Result<Option<(vgpu_protocol::ErrorCode, u64)>> {
            self.shared.fifo.channel_error(ch)
        }

        fn kill_channel(
            &self,
            ch: $crate::hal::ChannelId,
            code: vgpu_protocol::ErrorCode,
        ) -> $crate::hal::Result<()> {
            self.shared.fifo.kill_channel(ch, code)
        }
    };
}
pub(crate) use table_methods;
